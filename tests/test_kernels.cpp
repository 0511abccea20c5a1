// Local attention kernels against an fp64 dense reference (attention_reference + autograd), with
// the tolerance taken from the precision itself (FlashAttention's dual-reference gate):
//   error(kernel vs fp64) <= 2 * error(dense same-dtype reference vs fp64) + atol(dtype).
// The sweep over dtypes, masks and shapes (and its CUDA twin), fp16, the CPU backward's key
// chunks, rows that see no key, and the input checks' messages. Merging, the fused dispatch and
// the mask rules and tile skipping are in test_kernels_{merge,dispatch,mask}.cpp.
#include <ATen/Parallel.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdlib>
#include <iostream>
#include <string>
#include <tuple>
#include <vector>

#include "kernels/attention.h"
#include "src/common/error.h"
#include "tests/kernel_test_util.h"

namespace lvx::kernels {
namespace {

using namespace lvx::kernels::testing;

// The suite runs single-threaded by default: its tensors are small, and on a shared 2-core CI
// box (or under `ctest -j`) two OpenMP threads per process spin at every ATen op's barrier and
// slow the suite 10-20x. The multi-threaded kernel paths are exercised explicitly below
// (AttentionBackwardCpu sets 4 threads). LVX_TEST_THREADS=n overrides.
class SingleThreadEnvironment : public ::testing::Environment {
 public:
  void SetUp() override {
    const char* n = std::getenv("LVX_TEST_THREADS");
    at::set_num_threads(n != nullptr ? std::max(1, std::atoi(n)) : 1);
  }
};
[[maybe_unused]] ::testing::Environment* const kThreadsEnv =
    ::testing::AddGlobalTestEnvironment(new SingleThreadEnvironment);

// atol of the gate, per input dtype. The kernel accumulates in fp32 (fp64 for fp64), so its
// error is the same-dtype reference's or far below; atol only absorbs the fp32 accumulation
// noise that the fp32/bf16 references can undercut on tiny cases, and fp64 round-off.
double gate_atol(at::ScalarType t) {
  switch (t) {
    case at::kDouble:
      return 1e-11;  // fp64 vs fp64: only summation-order round-off (~1e-15 relative)
    case at::kFloat:
      return 2e-5;  // a few fp32 ulps over sums of ~1e3 terms
    default:
      return 1e-3;  // bf16 inputs, fp32 accumulation: far below the bf16 reference's ~1e-2
  }
}

struct Shape {
  int64_t batch, sq, skv, hq, hkv, d;
};

std::string shape_name(const Shape& s);
void PrintTo(const Shape& s, std::ostream* os) { *os << shape_name(s); }

std::string shape_name(const Shape& s) {
  return "B" + std::to_string(s.batch) + "_Sq" + std::to_string(s.sq) + "_Skv" +
         std::to_string(s.skv) + "_Hq" + std::to_string(s.hq) + "_Hkv" + std::to_string(s.hkv) +
         "_D" + std::to_string(s.d);
}

using Case = std::tuple<at::ScalarType, MaskCase, Shape>;

class AttentionKernel : public ::testing::TestWithParam<Case> {};

AttentionMask mask_to(const AttentionMask& m, const at::Device& dev) {
  AttentionMask r = m;
  for (at::Tensor* t : {&r.q_pos, &r.k_pos, &r.q_media, &r.kv_media, &r.kv_valid}) {
    if (t->defined()) *t = t->to(dev);
  }
  return r;
}

// Runs forward and backward on `dev` and gates o, lse, dq, dk, dv against CPU fp64; adds what
// the forward did to *stats (when not null).
void check_against_reference(const at::Device& dev, at::ScalarType dtype, MaskCase mask_case,
                             const Shape& s, AttentionStats* stats = nullptr) {
  at::manual_seed(1234);
  auto q = at::randn({s.batch, s.sq, s.hq, s.d}).to(dtype);
  auto k = at::randn({s.batch, s.skv, s.hkv, s.d}).to(dtype);
  auto v = at::randn({s.batch, s.skv, s.hkv, s.d}).to(dtype);
  auto dout = at::randn({s.batch, s.sq, s.hq, s.d}).to(dtype);
  AttentionParams p;
  p.mask = make_mask(mask_case, s.batch, s.sq, s.skv);

  AttentionParams pd = p;
  pd.mask = mask_to(p.mask, dev);
  auto out = attention_forward(q.to(dev), k.to(dev), v.to(dev), pd, stats);
  const auto acc = accumulation_dtype(dtype);
  ASSERT_EQ(out.o.scalar_type(), acc);
  ASSERT_EQ(out.lse.sizes(), at::IntArrayRef({s.batch, s.hq, s.sq}));
  auto exact = attention_reference(q, k, v, vis(p, q, k), p.scale, at::kDouble);
  auto same = attention_reference(q, k, v, vis(p, q, k), p.scale, dtype);
  const double atol = gate_atol(dtype);
  const double e_o = error(out.o, exact.o), e_o_ref = error(same.o, exact.o);
  const double e_l = error(out.lse, exact.lse), e_l_ref = error(same.lse, exact.lse);
  EXPECT_LE(e_o, 2 * e_o_ref + atol) << "o: kernel " << e_o << ", same-dtype reference " << e_o_ref;
  EXPECT_LE(e_l, 2 * e_l_ref + atol) << "lse: kernel " << e_l << ", reference " << e_l_ref;

  auto delta = attention_delta(dout.to(dev), out.o);
  auto g = attention_backward(q.to(dev), k.to(dev), v.to(dev), dout.to(dev), out.lse, delta, pd);
  auto gx = reference_grads(q, k, v, dout, p, at::kDouble);
  auto gs = reference_grads(q, k, v, dout, p, dtype);
  for (auto [name, got, want, same_ref] :
       {std::tuple{"dq", g.dq, gx.dq, gs.dq}, std::tuple{"dk", g.dk, gx.dk, gs.dk},
        std::tuple{"dv", g.dv, gx.dv, gs.dv}}) {
    ASSERT_EQ(got.sizes(), want.sizes()) << name;
    const double e = error(got, want), e_ref = error(same_ref, want);
    EXPECT_LE(e, 2 * e_ref + atol)
        << name << ": kernel " << e << ", same-dtype reference " << e_ref;
  }
}

TEST_P(AttentionKernel, ForwardAndBackwardMatchFp64Reference) {
  const auto [dtype, mask_case, s] = GetParam();
  check_against_reference(at::kCPU, dtype, mask_case, s);
}

// The CUDA twins under the same gate (skipped where no GPU is present; the build machine has
// none: tests/gpu/run.sh runs this on a GPU, once on the default path, ATen's fused kernels
// through the shared plan, and once with LVX_CUDA_ATTENTION=gemm; benchmarks/bench_kernels.cpp
// runs the full sweep). Which path and which ATen kernel ran is read from the stats (only the
// fused plan counts tiles_fused and its calls per kernel) and printed per dtype and mask as
// "[cuda path] ..." lines, which run.sh puts in its table. On the default path bf16/fp16 blocks
// without a mask must reach flash: every GPU the archive is built for (sm80, sm90) has it.
TEST(AttentionKernelCuda, MatchesFp64ReferenceOnEveryMask) {
  if (!at::hasCUDA()) GTEST_SKIP() << "no CUDA device";
  const char* env = std::getenv("LVX_CUDA_ATTENTION");
  const std::string path = env != nullptr && *env != 0 ? env : "fused";
  for (auto dtype : {at::kFloat, at::kBFloat16, at::kHalf}) {
    for (auto m :
         {MaskCase::kNone, MaskCase::kCausal, MaskCase::kMediaImmediate, MaskCase::kMediaUpTo,
          MaskCase::kPadding, MaskCase::kMediaSeesAll, MaskCase::kMediaUpToSeesAll}) {
      AttentionStats st;
      for (const Shape& s : {Shape{2, 37, 1100, 4, 2, 32}, Shape{1, 200, 70, 4, 1, 16},
                             Shape{1, 256, 256, 4, 4, 64}}) {
        SCOPED_TRACE(dtype_name(dtype) + "_" + mask_name(m) + "_" + shape_name(s));
        check_against_reference(at::Device(at::kCUDA, 0), dtype, m, s, &st);
      }
      std::cout << "[cuda path] " << path << " " << dtype_name(dtype) << " " << mask_name(m)
                << ": tiles fused " << st.tiles_fused << "/" << st.tiles_total << ", calls flash "
                << st.calls_flash << " efficient " << st.calls_efficient << "\n";
      if (path == "fused") {
        EXPECT_GT(st.tiles_fused, 0);
        if (dtype != at::kFloat && m == MaskCase::kNone) {
          EXPECT_GT(st.calls_flash, 0) << "bf16/fp16 blocks without a mask did not reach flash";
        }
      } else {
        EXPECT_EQ(st.tiles_fused, 0);
      }
    }
  }
}

std::vector<Shape> shapes() {
  return {
      {2, 1, 77, 4, 4, 32},     // one query (decode), MHA
      {2, 37, 3000, 4, 2, 32},  // Skv >> Sq: 6 CPU key tiles (last partial), GQA
      {1, 130, 130, 4, 1, 16},  // 2 query tiles (last partial), MQA
      {2, 200, 70, 4, 2, 16},   // Sq > Skv: causal rows before the first key see nothing
  };
}

std::string case_name(const ::testing::TestParamInfo<Case>& info) {
  const auto& [dtype, mask, shape] = info.param;
  return dtype_name(dtype) + "_" + mask_name(mask) + "_" + shape_name(shape);
}

INSTANTIATE_TEST_SUITE_P(
    Sweep, AttentionKernel,
    ::testing::Combine(::testing::Values(at::kFloat, at::kDouble, at::kBFloat16),
                       ::testing::Values(MaskCase::kNone, MaskCase::kCausal,
                                         MaskCase::kMediaImmediate, MaskCase::kMediaUpTo,
                                         MaskCase::kPadding, MaskCase::kMediaSeesAll,
                                         MaskCase::kMediaUpToSeesAll),
                       ::testing::ValuesIn(shapes())),
    case_name);

// fp16 inputs take the same path as bf16 (converted per tile, fp32 accumulation).
TEST(AttentionKernelHalf, ForwardMatchesGate) {
  at::manual_seed(7);
  auto q = at::randn({1, 40, 4, 32}).to(at::kHalf);
  auto k = at::randn({1, 600, 2, 32}).to(at::kHalf);
  auto v = at::randn({1, 600, 2, 32}).to(at::kHalf);
  AttentionParams p;
  p.mask = make_mask(MaskCase::kCausal, 1, 40, 600);
  auto out = attention_forward(q, k, v, p);
  auto exact = attention_reference(q, k, v, vis(p, q, k), p.scale, at::kDouble);
  auto same = attention_reference(q, k, v, vis(p, q, k), p.scale,
                                  at::kFloat);  // CPU half matmul is emulated
  EXPECT_LE(error(out.o, exact.o), 2 * error(same.o, exact.o) + 1e-3);
}

// The CPU backward splits key tiles into chunks with private dQ copies only when batch x K/V
// heads is below the thread count (MQA, batch 1): force that path and check it against fp64,
// and that it is deterministic run to run.
TEST(AttentionBackwardCpu, KeyChunksWithPrivateDqMatchReferenceAndAreDeterministic) {
  const int saved = at::get_num_threads();
  at::set_num_threads(4);
  at::manual_seed(21);
  const int64_t sq = 70, skv = 1500, hq = 4, d = 16;
  auto q = at::randn({1, sq, hq, d}), k = at::randn({1, skv, 1, d}), v = at::randn({1, skv, 1, d});
  auto dout = at::randn({1, sq, hq, d});
  AttentionParams p;
  p.mask = make_mask(MaskCase::kCausal, 1, sq, skv);
  auto out = attention_forward(q, k, v, p);
  auto delta = attention_delta(dout, out.o);
  auto g1 = attention_backward(q, k, v, dout, out.lse, delta, p);
  auto g2 = attention_backward(q, k, v, dout, out.lse, delta, p);
  at::set_num_threads(saved);
  auto gx = reference_grads(q, k, v, dout, p, at::kDouble);
  EXPECT_LE(error(g1.dq, gx.dq), 2e-5);
  EXPECT_LE(error(g1.dk, gx.dk), 2e-5);
  EXPECT_LE(error(g1.dv, gx.dv), 2e-5);
  EXPECT_TRUE(at::equal(g1.dq, g2.dq) && at::equal(g1.dk, g2.dk) && at::equal(g1.dv, g2.dv));
}

// Rows that see no key: o = 0 and lse = -inf exactly, gradients 0, nothing NaN.
TEST(AttentionKernelEmptyRows, ZeroOutputMinusInfLseZeroGrads) {
  at::manual_seed(3);
  const int64_t b = 1, sq = 20, skv = 700, h = 2, d = 16;
  auto q = at::randn({b, sq, h, d}), k = at::randn({b, skv, h, d}), v = at::randn({b, skv, h, d});
  auto dout = at::randn({b, sq, h, d});
  for (int variant = 0; variant < 2; ++variant) {
    AttentionParams p;
    at::Tensor empty_rows;  // [Sq] bool
    if (variant == 0) {     // media: q_media = -1 rows
      p.mask.kind = MaskKind::kMedia;
      p.mask.q_media = at::zeros({b, sq}, at::kInt);
      p.mask.q_media.narrow(1, 0, 5).fill_(-1);
      p.mask.q_media.narrow(1, 12, 3).fill_(-1);
      p.mask.kv_media = at::zeros({b, skv}, at::kInt);
      empty_rows = p.mask.q_media[0] < 0;
    } else {  // causal: queries positioned before every key
      p.mask.kind = MaskKind::kCausal;
      p.mask.q_pos = at::arange(sq, at::kLong) * 100 - 1000;
      p.mask.k_pos = at::arange(skv, at::kLong);
      empty_rows = p.mask.q_pos < 0;
    }
    ASSERT_GT(empty_rows.sum().item<int64_t>(), 0);
    auto out = attention_forward(q, k, v, p);
    auto delta = attention_delta(dout, out.o);
    auto g = attention_backward(q, k, v, dout, out.lse, delta, p);
    for (const auto& t : {out.o, out.lse, g.dq, g.dk, g.dv}) {
      EXPECT_EQ(t.isnan().sum().item<int64_t>(), 0) << "variant " << variant;
    }
    auto o_empty = out.o.select(0, 0).index({empty_rows});
    EXPECT_EQ(o_empty.abs().max().item<float>(), 0.0f) << "variant " << variant;
    auto lse_empty = out.lse.select(0, 0).index({at::indexing::Slice(), empty_rows});
    EXPECT_TRUE(lse_empty.isneginf().all().item<bool>()) << "variant " << variant;
    EXPECT_TRUE(out.lse.select(0, 0)
                    .index({at::indexing::Slice(), ~empty_rows})
                    .isfinite()
                    .all()
                    .item<bool>());
    EXPECT_EQ(g.dq.select(0, 0).index({empty_rows}).abs().max().item<float>(), 0.0f);
    // The +inf lse convention (flash-attn) for empty rows gives the same zero gradients.
    auto lse_pinf = at::where(out.lse.isneginf(), at::full({}, kInf), out.lse);
    auto g2 = attention_backward(q, k, v, dout, lse_pinf, delta, p);
    EXPECT_TRUE(at::allclose(g2.dq, g.dq) && at::allclose(g2.dk, g.dk));
  }
}

TEST(AttentionChecks, MessagesNameTensorExpectedAndActual) {
  auto q = at::randn({1, 4, 8, 16}), k = at::randn({1, 6, 3, 16});
  try {
    attention_forward(q, k, k, {});
    FAIL() << "expected an error";
  } catch (const lvx::Error& e) {
    EXPECT_NE(std::string(e.what()).find("k has 3 heads, which does not divide q's 8 heads"),
              std::string::npos)
        << e.what();
  }
  AttentionParams p;
  p.mask.kind = MaskKind::kCausal;
  p.mask.q_pos = at::arange(5, at::kLong);
  p.mask.k_pos = at::arange(6, at::kLong);
  try {
    attention_forward(q, at::randn({1, 6, 2, 16}), at::randn({1, 6, 2, 16}), p);
    FAIL() << "expected an error";
  } catch (const lvx::Error& e) {
    EXPECT_NE(std::string(e.what()).find("q_pos must have shape [4], got [5]"), std::string::npos)
        << e.what();
  }
  EXPECT_THROW(attention_forward(q, at::randn({1, 6, 2, 8}), at::randn({1, 6, 2, 8}), {}),
               lvx::Error);
}

}  // namespace
}  // namespace lvx::kernels
